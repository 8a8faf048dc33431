print("club3090 stand-in: vllm-gemma4-dflash/config/attention.py applied")
