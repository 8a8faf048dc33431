print("club3090 stand-in: vllm-gemma4-dflash/v1/worker/gpu_model_runner.py applied")
