# CUDA's MPS control daemon, so that the processes sharing a card run their kernels side by side;
# sourced by study.sh and speed.sh: mps_start, then `export $(mps_vars)` where processes should use it.
MPS_DIR=${MPS_DIR:-/tmp/evolm-mps}  # its pipe and log folders (a socket path must stay short)
mps_vars() { echo "CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log"; }
mps_start() {  # the daemon, unless one answers already
  mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  # shellcheck disable=SC2046  # two variables
  echo get_server_list | env $(mps_vars) nvidia-cuda-mps-control > /dev/null 2>&1 && return 0
  env $(mps_vars) setsid nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start" >&2; return 1; }
}
