# rigup stand-in for scripts/detect_nvlink.sh (sourced by the entrypoint).
# NVLINK_MODE=auto|force_on|force_off; exports _NVLINK_ENABLED and the NCCL/allocator variables.
NVLINK_MODE="${NVLINK_MODE:-auto}"
case "$NVLINK_MODE" in
  force_on)  _NVLINK_ENABLED=1 ;;
  force_off) _NVLINK_ENABLED=0 ;;
  auto)
    if nvidia-smi topo -m 2>/dev/null | grep -q 'NV[0-9]'; then _NVLINK_ENABLED=1; else _NVLINK_ENABLED=0; fi ;;
  *)
    echo "[nvlink] NVLINK_MODE must be auto, force_on or force_off (got '$NVLINK_MODE')" >&2
    exit 1 ;;
esac
export _NVLINK_ENABLED
if [ "$_NVLINK_ENABLED" = "1" ]; then
  export NCCL_P2P_LEVEL=NVL
  unset NCCL_P2P_DISABLE
  PYTORCH_CUDA_ALLOC_CONF="$(printf '%s' "${PYTORCH_CUDA_ALLOC_CONF:-max_split_size_mb:512}" | sed -e 's/expandable_segments:[^,]*//g' -e 's/,,*/,/g' -e 's/^,//' -e 's/,$//')"
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-max_split_size_mb:512}"
else
  export NCCL_P2P_DISABLE=1
  unset NCCL_P2P_LEVEL
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True,max_split_size_mb:512}"
fi
echo "[nvlink] mode=$NVLINK_MODE _NVLINK_ENABLED=$_NVLINK_ENABLED NCCL_P2P_LEVEL=${NCCL_P2P_LEVEL:-} NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE:-} PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"
