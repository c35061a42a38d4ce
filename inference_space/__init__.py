"""An inference replica whose weights follow a sparsesync bucket, deployable as a Docker Space.

A replica serves OpenAI-compatible completions (with token ids, logprobs and the weight version
of each completion) from an engine (`engines/`: vLLM or embedded transformers) while a
`sparsesync.protocol.follower.Follower` keeps the engine at the newest committed version. Run:
`python -m inference_space --model DIR --bucket URL --engine embedded|vllm`.
"""
