"""The writer wing: `publisher.Publisher` (the one entry point) and the parts it composes.

- `config`: `PublisherConfig`, the publisher's options, validated before anything is written.
- `mode`: `WriterMode`, the one interface every mode implements (the Publisher delegates to its
  mode and never asks which one it is), and what the modes share (`WriterContext`, `Tally`).
- `choice`: which mode a publisher runs: `open_mode` (the first; claims the writer epoch),
  `Undecided` (distributed, until the first state decides), `Passive` (replicated weights, rank > 0).
- `whole`: `WholeState`, one process diffs, encodes and uploads the whole state.
- `sharded`: `ShardedState`, every rank of a torch.distributed trainer its own shard;
  `sharded_commit`: its uploader's side (each rank's objects, rank 0's commit).
- `ranks`: what each rank holds (`shard_rows`, `checkpoint_shards`, `local_units`) and the
  collectives that gather across ranks (split from `sharded` to keep both under 450 lines).
- `stream`: `PartStream`, a delta in parts encoded by a mode and handed to the uploader part by part.
- `uploads`: `UploadQueue`, the versions waiting for upload: it only queues, coalesces and
  uploads (retries with backoff), calling the mode that started it for each commit.
- `commits`: `CommitWriter`, the writer epoch (claim, fence) and every object a version writes,
  the commit record last and confirmed visible; `CheckpointFiles`, the non-weight files.
- `anchors`: `AnchorPolicy`, when a version also carries a full anchor.
- `rewind`: a run continued from an older version (what a rewind commit abandons).
- `parts`: a version cut into parts and encoded (read back by `protocol.parts_reader`).
- `anchor_shards`: a sharded writer's anchors, one file per rank.

The path of a version: `Publisher` -> mode (`whole`/`sharded`: diff and encode against the
snapshot, `stream`/`uploads` to queue it); the uploader thread -> the mode's `upload` ->
`commits` (objects, then the commit record).

Each part has a small public interface; none imports another's private names, and none
imports `publisher` (the facade sits above them). Imports nothing from
`sparsesync.protocol.follower` (contract "wings" in pyproject.toml).
"""
