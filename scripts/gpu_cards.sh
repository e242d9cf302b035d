# Sourced by the scripts that deal processes over a lent machine's cards (gpu_study.sh, gpu_tune_study.sh).

on_card() {  # on_card TOTAL GPUS I: how many of TOTAL processes, dealt round-robin, share the card of the I-th
  echo $(($1 / $2 + (($3 % $2) < ($1 % $2) ? 1 : 0)))
}
