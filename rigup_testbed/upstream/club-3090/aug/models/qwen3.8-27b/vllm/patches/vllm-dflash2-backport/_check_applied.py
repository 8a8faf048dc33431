print("club3090 stand-in: vllm-dflash2-backport/_check_applied.py: backport not present")
