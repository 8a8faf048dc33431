print("club3090 stand-in: vllm-gdn-mtp-async-spec-order/patch_gdn_mtp_async_spec_order.py applied")
