"""The ``feduq`` command: one verb per task a site, a consortium or a researcher runs (:mod:`feduq.commands.main`).

Each verb is one small module with a ``main(argv)`` (NVFlare's CLI is the model: ``nvflare <verb>``, each verb its own
module), a thin layer over library functions of the package; the verbs are grouped by who uses them:
:mod:`~feduq.commands.site` (a hospital's site), :mod:`~feduq.commands.consortium` (whoever runs the federation) and
:mod:`~feduq.commands.research` (comparing methods on identical data)."""
