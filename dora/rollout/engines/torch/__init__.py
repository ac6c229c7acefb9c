"""The `torch` engine (``engine.TorchEngine``) and what only it uses: continuous batching in KV cache slots
(``slots``, ``batch``), the attention masks that keep each sequence to its own (``attention``), CUDA graphs of a
decode step (``graphs``), sampling on the device (``sampling``) and LoRA adapter versions in one batch
(``adapters``)."""
