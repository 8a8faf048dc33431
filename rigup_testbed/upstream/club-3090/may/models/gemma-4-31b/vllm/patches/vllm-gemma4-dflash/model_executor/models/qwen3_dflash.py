print("club3090 stand-in: vllm-gemma4-dflash/model_executor/models/qwen3_dflash.py applied")
