# Sourced by the scripts that deal processes over a lent machine's cards (gpu_study.sh, gpu_tune_study.sh).

on_card() {  # on_card TOTAL GPUS I: how many of TOTAL processes, dealt round-robin, share the card of the I-th
  echo $(($1 / $2 + (($3 % $2) < ($1 % $2) ? 1 : 0)))
}

mps_daemon() {  # mps_daemon DIR: CUDA's MPS control daemon, its pipe and log under DIR, started unless one answers there
  mkdir -p "$1/pipe" "$1/log"
  echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$1/pipe nvidia-cuda-mps-control > /dev/null 2>&1 && return 0
  CUDA_MPS_PIPE_DIRECTORY=$1/pipe CUDA_MPS_LOG_DIRECTORY=$1/log setsid nvidia-cuda-mps-control -d
}
