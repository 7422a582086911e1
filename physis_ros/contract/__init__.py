"""What a model asks of the robot and gives back, as data both sides read (numpy only).

``model``: a world-action model's contract (its actions, camera, state inputs by name and
source, how its prompt is made, how far committed rows reach), stored in its weights'
metadata; ``timeline``: the robot-clock rules for rows of actions (which rows are known,
interpolation, executing chunks), shared by the server, the robot and the closed-loop
evaluation; ``safetensors``: reading a weights file's header without torch.
Imports nothing of physis_ros outside this package.
"""
