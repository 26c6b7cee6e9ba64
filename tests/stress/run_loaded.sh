#!/usr/bin/env bash
# Run pytest while CPU hogs keep every core busy, to prove the suite passes on a loaded machine.
# Usage: tests/stress/run_loaded.sh [pytest arguments]   (TOKENWEIR_HOGS sets the hog count,
# default `nproc`). Exits with pytest's status; the hogs die with this script, however it ends.
set -u

hogs=${TOKENWEIR_HOGS:-$(nproc)}
python=${PYTHON:-python3}
parent=$$
pids=()

stop_hogs() {
    if ((${#pids[@]})); then
        kill "${pids[@]}" 2>/dev/null
        wait "${pids[@]}" 2>/dev/null
    fi
    pids=()
}
trap stop_hogs EXIT
# A signal ends the script (running the EXIT trap) with the shell's usual status for it.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

for ((n = 0; n < hogs; n++)); do
    # A busy loop of shell builtins at normal priority. It also checks every ~0.1 s that this
    # script still runs, so the hog stops even if the script is killed with SIGKILL (no trap).
    (
        trap - EXIT HUP INT TERM
        while kill -0 "$parent" 2>/dev/null; do
            for ((i = 0; i < 20000; i++)); do :; done
        done
    ) &
    pids+=($!)
done
echo "run_loaded: ${hogs} CPU hogs (pids ${pids[*]}) on $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2

began=$SECONDS
"$python" -m pytest "$@"
status=$?
echo "run_loaded: pytest exited ${status} after $((SECONDS - began)) s; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit "$status"
