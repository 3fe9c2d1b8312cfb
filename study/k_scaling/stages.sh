# Sourced by study v7's part A and D plans after their seed-0 screen (they set $R, $C and $O): `v7_stages K INNER`
# runs v7.py's stages — edges (one seed-0 point past the edge of each method's best), seed1 (seed 1 of each method's
# three best), final (seeds 0–4 at the pick by the mean of seeds 0–1) — and starts over from edges after any run,
# until no stage has a run left. Each `v7 jobs` call first waits for the cell's runs in flight that its stage is chosen
# from (seed 0's; the final stage's seeds 0 and 1) and leaves out the runs another runner holds, so two runners share a
# stage's runs and end on the same picks whichever finishes first; a walk past an edge goes on until the best is
# interior.
v7_stages() {
    local K=$1 inner=$2 stage lines ran pass
    for pass in $(seq 1 40); do
        ran=0
        for stage in edges seed1 final; do
            [ -e study/STOP ] && return 0
            lines=$(python -m study.k_scaling.v7 jobs --K "$K" --inner "$inner" --stage "$stage") || {
                echo "v7 jobs --K $K --inner $inner --stage $stage failed: stopping" >&2
                return 1
            }
            [ -z "$lines" ] && continue
            while read -r schedule inner_lr lrs seeds; do
                $R $C --outer-schedule "$schedule" --inner-lr "$inner_lr" --seeds "$seeds" --lrs "$lrs" --out $O ||
                    return 1
            done <<< "$lines"
            ran=1
            break
        done
        [ $ran = 0 ] && return 0
    done
    echo "v7_stages K $K ($inner): still runs left after $pass passes: stopping" >&2
    return 1
}
