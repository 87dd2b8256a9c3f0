# Shared by the staged device scripts (tests/gpu/first_run.sh, scripts/device_gpu_decode.sh):
# source it after setting T0=$SECONDS and BUDGET_S.
#   left: seconds of BUDGET_S left; stage TEXT: a heading with the seconds spent so far;
#   capped CAP CMD...: run CMD under the smaller of CAP and the time left (124 when none is).
# shellcheck shell=bash
left() { echo $((BUDGET_S - (SECONDS - T0))); }
stage() { printf '\n=== [%3d s] %s\n' $((SECONDS - T0)) "$*"; }
capped() {
  local cap=$1 t
  shift
  t=$(left)
  ((t > cap)) && t=$cap
  if ((t < 10)); then
    echo "no time left for: $*"
    return 124
  fi
  timeout "$t" "$@"
}
