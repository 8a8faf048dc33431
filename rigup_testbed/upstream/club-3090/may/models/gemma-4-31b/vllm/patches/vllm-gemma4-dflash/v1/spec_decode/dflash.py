print("club3090 stand-in: vllm-gemma4-dflash/v1/spec_decode/dflash.py applied")
