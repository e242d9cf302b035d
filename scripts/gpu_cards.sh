# Sourced by the scripts that deal processes over a lent machine's cards (gpu_study.sh, gpu_tune_study.sh).

on_card() {  # on_card TOTAL GPUS I: how many of TOTAL processes, dealt round-robin, share the card of the I-th
  echo $(($1 / $2 + (($3 % $2) < ($1 % $2) ? 1 : 0)))
}

MPS_DIR=${MPS_DIR:-/tmp/evolm-mps}  # CUDA MPS's control daemon: its pipe and log folders (a socket path is short)

mps_vars() {  # the variables that send a process to the daemon under MPS_DIR
  echo "CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log"
}

mps_daemon() {  # CUDA's MPS control daemon under MPS_DIR, started unless one answers there
  mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  echo get_server_list | env $(mps_vars) nvidia-cuda-mps-control > /dev/null 2>&1 && return 0
  env $(mps_vars) setsid nvidia-cuda-mps-control -d
}
