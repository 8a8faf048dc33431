print("club3090 stand-in: vllm-pr40391-rebased/model_executor/layers/attention/attention.py applied")
