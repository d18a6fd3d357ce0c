"""The loss a 3D site trains FedAvg's family with is nnU-Net's trainer's own (``nnUNetTrainer._build_loss``), value
for value on the same deep-supervised logits, for a task of plain labels and for one of nested regions (whose sites
train the task's mutually exclusive classes with a softmax, so nnU-Net's loss for those classes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

ARCH = {"network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        "arch_kwargs": {"n_stages": 4, "features_per_stage": [8, 16, 32, 64],
                        "conv_op": "torch.nn.modules.conv.Conv3d",
                        "kernel_sizes": [[1, 3, 3], [1, 3, 3], [3, 3, 3], [3, 3, 3]],
                        "strides": [[1, 1, 1], [1, 2, 2], [1, 2, 2], [2, 2, 2]], "n_conv_per_stage": [2, 2, 2, 2],
                        "n_conv_per_stage_decoder": [2, 2, 2], "conv_bias": True,
                        "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
                        "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None,
                        "dropout_op_kwargs": None, "nonlin": "torch.nn.LeakyReLU", "nonlin_kwargs": {"inplace": True}},
        "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"]}
#: the slim plan `feduq plan` wrote for two prostate sites of 6 cases (RUNMC, BMC), its 3d_fullres configuration
PLANS = {"dataset_name": "Dataset901_ProstateMR", "plans_name": "FedUQ_federated_slim",
         "original_median_spacing_after_transp": [3.3, 0.5, 0.5], "original_median_shape_after_transp": [18, 384, 384],
         "image_reader_writer": "SimpleITKIO", "transpose_forward": [0, 1, 2], "transpose_backward": [0, 1, 2],
         "label_manager": "LabelManager", "experiment_planner_used": "ExperimentPlanner",
         "foreground_intensity_properties_per_channel": {"0": {"mean": 86.9, "median": 79.9, "std": 36.1, "min": 0.0,
                                                               "max": 255.0, "percentile_99_5": 194.8,
                                                               "percentile_00_5": 17.7}},
         "configurations": {"3d_fullres": {
             "data_identifier": "nnUNetPlans_3d_fullres", "preprocessor_name": "DefaultPreprocessor", "batch_size": 2,
             "patch_size": [16, 64, 64], "median_image_size_in_voxels": [19.0, 96.0, 96.0],
             "spacing": [3.0, 2.0, 2.0], "normalization_schemes": ["ZScoreNormalization"], "use_mask_for_norm": [False],
             "resampling_fn_data": "resample_data_or_seg_to_shape",
             "resampling_fn_seg": "resample_data_or_seg_to_shape",
             "resampling_fn_data_kwargs": {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None},
             "resampling_fn_seg_kwargs": {"is_seg": True, "order": 1, "order_z": 0, "force_separate_z": None},
             "resampling_fn_probabilities": "resample_data_or_seg_to_shape",
             "resampling_fn_probabilities_kwargs": {"is_seg": False, "order": 1, "order_z": 0,
                                                    "force_separate_z": None},
             "architecture": ARCH, "batch_dice": False,
             "pool_op_kernel_sizes": [[1, 1, 1], [1, 2, 2], [1, 2, 2], [2, 2, 2]],
             "conv_kernel_sizes": [[1, 3, 3], [1, 3, 3], [3, 3, 3], [3, 3, 3]]}}}

PLAIN = {"background": 0, "PZ": 1, "TZ": 2}
REGIONS = {"background": 0, "gland": [1, 2], "TZ": 2}


def _nnunet_trainer_loss(pipeline):
    """``nnUNetTrainer._build_loss`` itself, run on a stand-in holding the site pipeline's plan and label manager."""
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    stand_in = SimpleNamespace(label_manager=pipeline.label_manager, configuration_manager=pipeline.cm,
                               is_ddp=False, enable_deep_supervision=True, _do_i_compile=lambda: False)
    stand_in._get_deep_supervision_scales = lambda: nnUNetTrainer._get_deep_supervision_scales(stand_in)
    return nnUNetTrainer._build_loss(stand_in)


@pytest.mark.parametrize("labels", [PLAIN, REGIONS], ids=["labels", "regions"])
def test_fedavgs_3d_loss_is_nnunets_trainers_on_the_same_logits(labels):
    from feduq.data import get_task
    from feduq.site.site3d import Site3D

    name = "Dataset946_LossLabels" if labels is PLAIN else "Dataset947_LossRegions"  # one declaration per name
    declaration = {"name": name, "channel_names": {"0": "T2"}, "labels": labels,
                   "file_ending": ".nii.gz", "feduq": {"sites": ["RUNMC", "BMC"]},
                   **({"regions_class_order": [1, 2]} if labels is REGIONS else {})}
    site = Site3D(PLANS, task=declaration, device="cpu")
    pipeline = site.make_pipeline(get_task(site.task_name))
    assert not pipeline.label_manager.has_regions  # the sites train the task's 3 exclusive classes
    ours, theirs = pipeline.build_loss(), _nnunet_trainer_loss(pipeline)
    assert type(theirs.loss).__name__ == "DC_and_CE_loss"
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 16, 64, 64), (2, 16, 32, 32), (2, 16, 16, 16)]  # the plan's 3 deep-supervision outputs
    logits = [torch.randn(2, 3, *s[1:], generator=g) * 3 for s in shapes]
    target = [torch.randint(0, 3, (2, 1, *s[1:]), generator=g).float() for s in shapes]
    a, b = float(ours(logits, target)), float(theirs(logits, target))
    assert np.isfinite(a) and a == pytest.approx(b, rel=1e-6, abs=1e-7), (a, b)
    # the lowest output has weight 0 (nnU-Net's): changing it changes neither loss
    logits[2] = logits[2] * 0
    assert float(ours(logits, target)) == pytest.approx(a, rel=1e-6)
