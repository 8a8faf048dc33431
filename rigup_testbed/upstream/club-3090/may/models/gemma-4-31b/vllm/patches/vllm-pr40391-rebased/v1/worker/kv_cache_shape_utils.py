print("club3090 stand-in: vllm-pr40391-rebased/v1/worker/kv_cache_shape_utils.py applied")
