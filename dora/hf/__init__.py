"""Hugging Face model folders as dora reads them: where a named model is (a folder, or a hub id in the cache),
and what the folder says (where a turn ends, how long a sequence may be, what the engines can run).

``dora.hf.folder`` reads config files and the tokenizer side only (no torch: the broker and `dora run` call it
before any process starts); ``dora.hf.checks`` turns a user's mistakes into one line each; ``dora.hf.tensors``
is the torch side (tied parameters, the blocks FSDP2 wraps).
"""
