"""How a run is driven from outside its stages: compile, run on this machine, resume, schedule.

- `prepare`: what every run does before its stages start: preflight checks, absolute paths,
  the MLflow run (new or resumed) and the version a resumed run continues from.
- `compile`: `moerl compile`, a run config as KFP IR YAML for kfp.local or EKS.
- `sync_run`: `moerl run`, the sync pipeline on kfp.local.
- `async_run`: `moerl run --mode async`, the async pipeline's stage entrypoints as local
  processes around an embedded Valkey, supervised as KFP's retries would do it.
- `schedule`, `cron`: `moerl schedule` and `moerl submit` (KFP recurring runs, Argo CronWorkflow).

This package sits above `moerl/pipelines` and the components: it imports them, they never
import it. How a stage's own processes start and live (the pod's scratch, child processes,
workloads launched through the Kubernetes API) is `moerl.launch`, below the components.
"""
