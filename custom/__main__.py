"""``python -m feduq <verb>``: the ``feduq`` command (:mod:`feduq.commands.main`) without its installed script."""

from .commands.main import console

if __name__ == "__main__":
    console()
