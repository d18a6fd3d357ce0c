"""nnU-Net v2 as FedUQ's library for planned networks, FLARE-free: a site's pipeline from a plan (network, loss,
preprocessing, loader, nnU-Net's training iterations; :mod:`feduq.nnunet.pipeline`), the shipped plans
(``plans/``) and a federation's own plan from the sites' fingerprints (:mod:`feduq.nnunet.federated_plans`). The
multi-head CT jobs (:mod:`feduq.ct`) and the 3D volume site (:mod:`feduq.site.site3d`) build on it."""
