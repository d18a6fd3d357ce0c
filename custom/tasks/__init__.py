"""Tasks: what a federation segments. One task type, :class:`~feduq.tasks.task.TaskSpec`, read from a task file
(nnU-Net's ``dataset.json`` with FedUQ's ``"feduq"`` keys, :mod:`~feduq.tasks.declared`), a built-in task's
(``task_files/``) and a consortium's alike; the registry (:mod:`~feduq.tasks.spec`: :func:`~feduq.tasks.spec.get_task`
takes a name or a path, :func:`~feduq.tasks.spec.job_task` a job's task value)."""
