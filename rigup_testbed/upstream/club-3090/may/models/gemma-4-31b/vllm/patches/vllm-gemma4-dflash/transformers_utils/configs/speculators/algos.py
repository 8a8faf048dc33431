print("club3090 stand-in: vllm-gemma4-dflash/transformers_utils/configs/speculators/algos.py applied")
