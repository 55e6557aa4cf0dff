"""brorl_jax.workdir: the run's files and the process, apart from the RL step.

layout.py the work directory (what lives where, the lock, the kept warm start); checkpoint.py
orbax checkpoints; saved_config.py the run's brorl_config.json and what may change on resume;
logger.py metrics out of the loop (JSONL and the optional loggers, plots, progress bars);
signals.py SIGINT/SIGTERM as a stop at the next safe point. Nothing here imports the RL step
(train/, algo/, rollout/): tests/test_layering.py checks it. Import the modules themselves; this
package's __init__ imports nothing.
"""
