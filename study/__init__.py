"""The IsoLoCo-vs-DiLoCo study, one folder per question (README.md lists them): each holds its plans, its
summarizer, its results (results/*.jsonl, one run record a line) and its outputs. Shared: the runner
(run_study.py, plan_env.sh), the pipeline that regenerates every summary and plot (summarize.py) and the
README's generated sentences (readme_numbers.py). Not part of the installed package."""
