print("club3090 stand-in: vllm-gemma4-dflash/v1/attention/selector.py applied")
