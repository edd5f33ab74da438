# shellcheck shell=bash
# scripts/gpt2_recipe.sh: what the run scripts here share, sourced by each (it runs nothing itself):
# the flags of llm.c's GPT-2 recipe (its scripts/run_gpt2_124M.sh) that every run keeps, and the
# loop that resumes a long run after a crash. Each script adds the flags that differ: the model
# (-e), data and output (-i -j -o), tokens per step (-d), learning rate (-l), steps (-x), the
# sample and checkpoint intervals (-s -n), and how processes start (-pm ...).

# validation every 250 steps (of -m's 20 batches), samples of 144 tokens (-g), HellaSwag,
# micro-batches of 64 x 1024 tokens, no
# recomputation (-r 0), ZeRO-1, weight decay 0.1, 700 warmup steps, the learning rate decayed to 0
# shellcheck disable=SC2034  # used by the scripts that source this file
GPT2_RECIPE=(-v 250 -g 144 -h 1 -b 64 -t 1024 -r 0 -z 1 -c 0.1 -u 700 -q 0.0)

# run_until_done DONE_FILE COMMAND...: run COMMAND, a gpt2_cuda.py run whose last checkpoint writes
# DONE_FILE, again after each stop or crash (they happen on long jobs), with -y 1 (resume from the
# newest checkpoint) once there is one, until DONE_FILE exists
run_until_done() {
    local done_file=$1 resume
    shift
    while [ ! -f "$done_file" ]; do
        resume=0
        if compgen -G "$(dirname "$done_file")/DONE_*" > /dev/null; then resume=1; fi
        "$@" -y "$resume"
        sleep 1
    done
    echo "$done_file exists: training is complete"
}
