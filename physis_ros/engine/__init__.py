"""Engine: the block-causal denoising model, its stages, KV caches, scheduler and placement.

Imports torch; never rclpy. Modules (pool/ is the shared-pool admission and simulator):
  config     presets (tiny, small, Wan2.1/2.2 backbones, 22B/33B) and the sampler config
  model      Wan2.1-style DiT modules (upstream key names), init, strict checkpoint loading
  forward    its math: embeddings, RoPE, one block, the head, forward_sequence (training)
  build      build_model: a model on its device with its block implementation chosen
  sampler    shifted flow-matching sigmas, seeded initial noise, packed chunk layout
  checkpoints  model directories (upstream Wan, diffusers): config, strict loading, summary
  prompts    prompt-embedding files, the conditioning a stream gets (never random tokens)
  frames     the camera frames of one chunk, checked and padded for every codec
  codec      image <-> latent: exact pixel space-to-depth, a VAE-shaped stand-in, or
  vae        the Wan VAE through diffusers, causal per stream
  oracle     offline full-sequence samplers (noisy and clean history) every mode must equal
  kvring     the KV ring of one (stream, stage) and the StageTask a block forward runs
  stage      one batched block forward over tasks (run_block), its caches, block timing
  fused      which block implementation runs (fused on CUDA, eager on the CPU) and the fused
             forward (one QKV GEMM, norm+RoPE into the ring, one-pass norms);
  fused_triton  its Triton kernels (CUDA)
  devcopy    host <-> device copies that never make the worker wait for the GPU
  placement  stages (k, l) -> virtual ranks -> worker ranks; printable
  worker     Worker.run_once: receive -> ready tasks -> group by block -> forward -> send
  relayout   a stream's state on a worker; its KV rings moving on a placement change
  transport  Activation and the Transport interface (InProcTransport here)
  controller slots, anchors, tickets; the release policy (pipelined / sequential-noisy /
             sequential-clean)
  executor   what the core asks of whatever runs the stages (Executor, StreamOrder)
  pipeline   a controller driving an executor: packed chunks in, results out (run_plan)
  threads    the executor of one process (worker threads); local_engine
  ranks/     the executor of a torch.distributed job (one rank per device); ranks_engine
  core       EngineCore: the one StreamEngine (codec, prompts, promises) over an executor
  api        what the server front end asks of an engine
"""
