print("club3090 stand-in: vllm-dflash2-backport/patch_topk_4arg_compat.py applied")
