"""Reading recorded bags: both storages, every image encoding, damaged and incomplete bags."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.eval.bag import BagReadError, read_episode
from physis_ros.eval.metrics import psnr
from physis_ros.sim.record import COMMAND_TOPIC, IMAGE_TOPIC, WRENCH_TOPIC
from physis_ros.sim.scene import PushScene, SceneConfig, ScriptedPolicy

from .bagtools import record_small, rewrite_bag


def _rendered_frames(seed: int, n: int, size: int = 32) -> np.ndarray:
    """The frames the recorder renders (camera 10 Hz, control 50 Hz), recomputed."""
    scene = PushScene(SceneConfig(seed=seed, image_height=size, image_width=size))
    policy = ScriptedPolicy(seed)
    frames = []
    for tick in range(n * 5):
        if tick % 5 == 0:
            frames.append(scene.render())
        scene.step(0.02, policy.joint_targets(scene, tick * 0.02))
    return np.stack(frames)


@pytest.fixture(scope="module")
def rgb_bag(tmp_path_factory):
    return record_small(tmp_path_factory.mktemp("bags") / "rgb", seed=2)


@pytest.mark.parametrize(
    ("encoding", "storage"),
    [
        ("rgb8", "mcap"),
        ("bgr8", "sqlite3"),
        ("rgba8", "mcap"),
        ("bgra8", "sqlite3"),
        ("png", "mcap"),
    ],
)
def test_lossless_encodings_decode_to_the_rendered_frames(tmp_path, encoding, storage):
    bag = record_small(tmp_path / "bag", seed=2, encoding=encoding, storage=storage)
    ep = read_episode(bag)
    expected = _rendered_frames(2, len(ep.frames))
    assert ep.storage == storage
    assert ep.frames.shape == (31, 32, 32, 3)
    assert np.array_equal(ep.frames, expected)
    assert ep.commands.shape == (150, 2) and ep.joint_names == ("shoulder", "elbow")
    assert ep.wrench.shape == (151, 6)
    assert abs(ep.frame_hz - 10.0) < 1e-6
    assert not ep.skipped


def test_lossy_and_gray_encodings_are_close(tmp_path):
    expected = _rendered_frames(2, 31)
    jpeg = read_episode(record_small(tmp_path / "jpeg", seed=2, encoding="jpeg"))
    assert jpeg.image_topic.endswith("/compressed")
    assert min(psnr(a, b) for a, b in zip(jpeg.frames, expected, strict=True)) > 30
    mono = read_episode(
        record_small(tmp_path / "mono", seed=2, encoding="mono8", storage="sqlite3")
    )
    luma = np.round(expected.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))
    assert np.array_equal(mono.frames[..., 0], luma.astype(np.uint8))
    assert np.array_equal(mono.frames[..., 0], mono.frames[..., 2])


def test_bare_storage_file_and_resize(rgb_bag):
    ep = read_episode(next(rgb_bag.glob("*.mcap")), image_size=(16, 16))
    assert ep.frames.shape == (31, 16, 16, 3) and ep.source_size == (32, 32)
    assert any("resized from 32x32 to 16x16" in n for n in ep.notes)


def test_corrupt_message_is_skipped_and_counted(rgb_bag, tmp_path):
    def corrupt(topic, i, raw, store):
        if topic == IMAGE_TOPIC and i == 5:
            return raw[:40]  # truncated CDR
        if topic == IMAGE_TOPIC and i == 9:
            msg = store.deserialize_cdr(raw, "sensor_msgs/msg/Image")
            msg.step = 7  # shorter than a row
            return store.serialize_cdr(msg, "sensor_msgs/msg/Image")
        if topic == IMAGE_TOPIC and i == 12:
            msg = store.deserialize_cdr(raw, "sensor_msgs/msg/Image")
            msg.encoding = "yuv422_yuy2"
            return store.serialize_cdr(msg, "sensor_msgs/msg/Image")
        return raw

    bad = rewrite_bag(rgb_bag, tmp_path / "bad", storage="sqlite3", edit=corrupt)
    good = read_episode(rgb_bag)
    ep = read_episode(bad)
    assert ep.skipped[(IMAGE_TOPIC, "corrupt_message")] == 1
    assert ep.skipped[(IMAGE_TOPIC, "bad_step")] == 1
    assert ep.skipped[(IMAGE_TOPIC, "unsupported_encoding")] == 1
    assert len(ep.frames) == len(good.frames) - 3
    kept = np.delete(good.frames, [5, 9, 12], axis=0)
    assert np.array_equal(ep.frames, kept)


def test_missing_topics_give_clear_errors_or_notes(rgb_bag, tmp_path):
    no_cmd = rewrite_bag(rgb_bag, tmp_path / "no_cmd", drop_topics=(COMMAND_TOPIC, WRENCH_TOPIC))
    with pytest.raises(BagReadError, match=r"commanded action.*needs the commands"):
        read_episode(no_cmd)
    ep = read_episode(no_cmd, require_commands=False)
    assert not ep.has_commands and len(ep.frames) == 31
    assert any("wrench" in n for n in ep.notes) and any(
        "action metrics skipped" in n for n in ep.notes
    )
    no_cam = rewrite_bag(rgb_bag, tmp_path / "no_cam", drop_topics=(IMAGE_TOPIC,))
    with pytest.raises(BagReadError, match="no camera image topic"):
        read_episode(no_cam)
    with pytest.raises(BagReadError, match=r"topic '/nope' \(camera image\) is not in the bag"):
        from physis_ros.eval.bag import TopicChoice

        read_episode(rgb_bag, topics=TopicChoice(image="/nope"))
    with pytest.raises(BagReadError, match="cannot open bag"):
        read_episode(tmp_path / "does_not_exist")


def test_actions_for_chunk_are_the_commands_in_force_before_each_frame(rgb_bag):
    ep = read_episode(rgb_bag)
    acts = ep.actions_for_chunk(4, 2, 2)
    for j, frame in enumerate((4, 5)):
        before = ep.command_stamps_ns < ep.frame_stamps_ns[frame]
        assert np.array_equal(acts[j], ep.commands[np.flatnonzero(before)[-1]])
