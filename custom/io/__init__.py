"""Reading images and volumes: 2D image files (:mod:`~feduq.io.image_files`), nnU-Net-named channel files
(:mod:`~feduq.io.channel_io`), volumes with their spacing (:mod:`~feduq.io.volumes`), the checks a volume must pass
before it is read as data (:mod:`~feduq.io.volume_checks`), the resize geometry (:mod:`~feduq.io.resize`) and the
MONAI transforms (:mod:`~feduq.io.transforms`)."""
