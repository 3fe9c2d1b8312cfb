# Sourced by study v7's part A and D plans after their seed-0 screen (they set $R, $C and $O): `v7_stages K INNER`
# runs v7.py's stages for each method — edges (one seed-0 point past the edge of its best), seed1 (seed 1 of its
# three best), final (seeds 0–4 at its pick by the mean of seeds 0–1, one seed a pass) — asking `v7 jobs --stage next` for each
# method's next runs after every batch, until it has none. A method's next stage is chosen from its finished runs
# only (the call waits while nothing is free and runs are in flight), and runs another runner holds are left out, so
# two runners share the runs and end on the same picks whichever finishes first; a walk past an edge goes on until
# the best is interior.
v7_stages() {
    local K=$1 inner=$2 lines pass
    for pass in $(seq 1 60); do
        [ -e study/STOP ] && return 0
        lines=$(python -m study.k_scaling.v7 jobs --K "$K" --inner "$inner" --stage next) || {
            echo "v7 jobs --K $K --inner $inner --stage next failed: stopping" >&2
            return 1
        }
        [ -z "$lines" ] && return 0
        while read -r schedule inner_lr lrs seeds; do
            $R $C --outer-schedule "$schedule" --inner-lr "$inner_lr" --seeds "$seeds" --lrs "$lrs" --out $O ||
                return 1
        done <<< "$lines"
    done
    echo "v7_stages K $K ($inner): still runs left after $pass passes: stopping" >&2
    return 1
}
