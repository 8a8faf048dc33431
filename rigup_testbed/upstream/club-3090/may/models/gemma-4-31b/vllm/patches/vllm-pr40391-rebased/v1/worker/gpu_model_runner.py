print("club3090 stand-in: vllm-pr40391-rebased/v1/worker/gpu_model_runner.py applied")
