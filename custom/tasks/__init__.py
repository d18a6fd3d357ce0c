"""Tasks: what a federation segments. The built-in tasks and a task file's reading (:mod:`~feduq.tasks.spec`: the
registry, :class:`~feduq.tasks.spec.TaskSpec`, :func:`~feduq.tasks.spec.get_task`, :class:`~feduq.tasks.spec.DataError`),
nnU-Net's ``dataset.json`` read as a declaration (:mod:`~feduq.tasks.declared`) and the packaged task files
(``task_files/``)."""
