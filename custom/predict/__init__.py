"""Predicting: a trained model applied to a site's cases. Where a case's kind (image, volume, DICOM series) is decided
(:mod:`~feduq.predict.files`), 2D planes in a pipeline (:mod:`~feduq.predict.planes`), a declared task's volumes
(:mod:`~feduq.predict.declared_cases`) and a 3D job's whole volumes (:mod:`~feduq.predict.volumes_3d`), the DICOM
Segmentation (:mod:`~feduq.predict.dicom_seg`), the rows of ``predictions.csv`` (:mod:`~feduq.predict.rows`), the
whole folder (:mod:`~feduq.predict.pipeline`) and ``--calibrate`` (:mod:`~feduq.predict.calibrate`). The verb is
:mod:`feduq.commands.site.predict`."""
