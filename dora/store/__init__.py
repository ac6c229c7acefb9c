"""The weight store: one model folder per published version, written atomically, checked on load, retired by the
broker.

Below the three processes: the learner publishes into it, the rollout engines check what they load against the
digest published with it, and the broker deletes the versions its ledger retired. The modules:

- ``publish``: ``WeightStore``, a version as a model folder (safetensors in the engines' dtype, sharded above a
  size, tied tensors once, the config and tokenizer beside them) renamed into place whole;
- ``writer``: a version's safetensors files written from the tensors' own memory in large spans, each chunk
  hashed from memory as it is written, the disk syncing while later chunks are written;
- ``snapshot``: ``HostSnapshot``, a learner's state copied into one reused, prefaulted host buffer laid out as the
  files will be (the learner's only wait for a version; the publish of its views writes the buffer's spans);
- ``manifest``: every file of a version with its chunk digests, and the digest they make;
- ``load``: the bytes checked are the bytes loaded (``load_verified``, ``load_into``); a model folder's digest
  (``model_digest``: what a LoRA version's base model is checked by);
- ``inline``: a small version (a LoRA adapter folder) as bytes carried in the messages: packed with its manifest
  and digest in memory (``pack``), checked as a folder is (``verified``), written into the store byte for byte
  (``write``);
- ``digest``: chunked digests (xxh3_128 or sha256 per 16 MiB chunk), hashed in parallel, in place or from the
  memory a file is written from;
- ``tensorfile``: a safetensors file mapped once, its tensors as views of the mapping;
- ``plane``, ``fetch`` and ``relays``: the weights' data plane, for workers that share no filesystem with the
  learner (``rollout.store``): a chunk server over ZeroMQ (one in the learner, one in each such worker, relaying
  what its node fetched), a fetcher that checks each chunk against the manifest and falls back source by source to
  the learner, and the tree of relays the broker names in each ``Assign``;
- ``collective``: a version broadcast from the learner's rank 0 to a group of workers with torch.distributed (a
  group of its own, gloo or NCCL, in buckets), each worker checking the bytes against the manifest before it
  adopts them;
- ``ipc``: a version's tensors mapped by another process on the same machine, not copied (CUDA IPC, or shared host
  memory), through handles of plain values;
- ``dirs``: the store's directories, a dead publisher's leftovers, retirement: all the broker imports. Nothing
  here imports torch until a version is published or loaded (``collective`` and ``ipc`` import it, and are
  imported by name only, never from here).

The ledger keeps at most K + 1 versions alive, so the store holds at most K + 2 while the next one is written.
A broker restarted from its journal holds only the newest version alive: it retires the older ones at once
(``retire_older``), or they would stay on disk for good.
"""

from dora.store.digest import DigestMismatch, sha256_file
from dora.store.dirs import retire_older, retire_uri, store_path
from dora.store.load import InPlaceUnfit, load_into, load_verified, model_digest
from dora.store.manifest import Manifest
from dora.store.publish import WeightStore

__all__ = ["DigestMismatch", "InPlaceUnfit", "Manifest", "WeightStore", "load_into", "load_verified", "model_digest",
           "retire_older", "retire_uri", "sha256_file", "store_path"]  # fmt: skip
