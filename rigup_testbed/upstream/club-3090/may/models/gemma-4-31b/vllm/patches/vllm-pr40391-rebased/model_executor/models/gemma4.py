print("club3090 stand-in: vllm-pr40391-rebased/model_executor/models/gemma4.py applied")
