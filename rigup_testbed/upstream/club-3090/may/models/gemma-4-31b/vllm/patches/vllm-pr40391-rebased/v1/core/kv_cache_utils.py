print("club3090 stand-in: vllm-pr40391-rebased/v1/core/kv_cache_utils.py applied")
