"""The nnU-Net raw sites the tests build from ../shared/data at test time: feduq convert nnunet-raw's builders."""

from conftest import load_tool

_tool = load_tool("make_nnunet_sites")
PROSTATE_LABELS = _tool.PROSTATE_LABELS
prostate_cases, prostate_site, polyp_site, polyp_task = (_tool.prostate_cases, _tool.prostate_site, _tool.polyp_site,
                                                         _tool.polyp_task)
task_declaration, write_site_json = _tool.task_declaration, _tool.write_site_json
prostate_slices_site = _tool.prostate_slices_site
fundus_region_task, FUNDUS_REGIONS, FUNDUS_SITES = _tool.fundus_region_task, _tool.FUNDUS_REGIONS, _tool.FUNDUS_SITES
