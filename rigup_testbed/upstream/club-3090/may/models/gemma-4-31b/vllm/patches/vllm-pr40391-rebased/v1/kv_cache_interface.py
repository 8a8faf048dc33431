print("club3090 stand-in: vllm-pr40391-rebased/v1/kv_cache_interface.py applied")
