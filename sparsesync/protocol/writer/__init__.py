"""The writer wing: `publisher.Publisher` (the one entry point) and the parts it composes.

- `config`: `PublisherConfig`, the publisher's options, validated before anything is written.
- `commits`: `CommitWriter`, the writer epoch (claim, fence) and every object a version writes,
  the commit record last and confirmed visible; `CheckpointFiles`, the non-weight files.
- `uploads`: `UploadQueue`, the versions waiting for upload, coalescing, retries with backoff.
- `anchors`: `AnchorPolicy`, when a version also carries a full anchor.
- `whole`: `WholeState`, one process diffs, encodes and uploads the whole state.
- `sharded`: `ShardedState`, every rank of a torch.distributed trainer its own shard.
- `ranks`: what each rank holds (`shard_rows`, `checkpoint_shards`, `local_units`) and the
  collectives that gather across ranks (split from `sharded` to keep both under 450 lines).
- `rewind`: a run continued from an older version (what a rewind commit abandons).
- `parts`: a version cut into parts and encoded (read back by `protocol.parts_reader`).
- `anchor_shards`: a sharded writer's anchors, one file per rank.

Each part has a small public interface; none imports another's private names, and none
imports `publisher` (the facade sits above them). Imports nothing from
`sparsesync.protocol.follower` (contract "wings" in pyproject.toml).
"""
