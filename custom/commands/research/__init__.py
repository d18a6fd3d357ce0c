"""The verbs of a researcher comparing methods on identical data: ``compare``, ``compare-report``, ``reference``,
``virtual``, ``convert``, ``split``, ``noisy-labels``, ``synthetic``, ``acceptance-study``."""
