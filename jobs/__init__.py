"""trajflow.jobs: how users run trajflow — the `trajflow` CLI, job configs, runs, Ray Jobs, replay.

    trajflow run quickstart                          # embedded Ray; writes runs/quickstart-snapshot-TIME/
    trajflow run my.yaml --set optimizer.lr=1e-4 --set steps=50
    trajflow run --resume runs/quickstart-snapshot-TIME     # after a crash: from the last checkpoint
    trajflow submit quickstart --address http://127.0.0.1:8265 \\
        --set 'generator.resources={gen_node: 0.1}' --set 'trainer.resources={train_node: 0.1}'
    trajflow status JOB_ID --address ...   /   trajflow stop JOB_ID --address ...
    trajflow replay RUN --checkpoints RUN/versions --strategy snapshot,recompute --diagnose
    trajflow replay RUN --checkpoints RUN/versions --strategy ewma --train

config.py    JobConfig = PipelineConfig + run options; load_job_config(path, ["key=value", ...])
run.py       run_job / resume_job: the driver (progress, status lines, TensorBoard)
preflight.py what is checked before Ray starts (GPUs, the cluster's resources, disk, resumed data)
summary.py   status lines, the summary table, placement.json
errors.py    RunError / RunFailed and the one line of a lost trainer, store or transfer
recorder.py  the run dir layout and RunRecorder, the trainer-side hooks that write it durably
submit.py    Ray Jobs API: submit (streams logs, returns the status), status, stop
report.py    report / compare: a summary table and one PNG of runs' curves
trackers.py  report_to: TensorBoard, W&B, MLflow; tracked_runs.py reads their runs back
console.py   terminal output: 100-column lines and tables, Ray's C++ notices filtered
cli.py       the argparse front end; bad input ends with one `trajflow: ...` line, exit status 2
configs/     quickstart.yaml and one config per strategy (`trajflow configs` lists them)

A run dir: config.yaml (resolved), run.json (state and sessions), metrics/step=N.parquet
(+ metrics.parquet), trajectories/step=N/part-0.parquet (schema v1, validated),
checkpoints/step-N/ (safetensors + JSON, the newest `keep_checkpoints`), versions/vN.safetensors
(save_all_versions), tensorboard/, summary.txt, placement.json (the node of each stage's
process). Nothing is pickled.
The embedded Ray is pipelines/ray/embedded.py (127.0.0.1 only; ended with the driver).
"""
