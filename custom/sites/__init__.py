"""Sites: a site's folder and its cases. The built-in centers (:mod:`~feduq.sites.centers`), a site in nnU-Net's raw
layout (:mod:`~feduq.sites.nnunet_raw`) and the splits (:mod:`~feduq.sites.split_files`)."""
