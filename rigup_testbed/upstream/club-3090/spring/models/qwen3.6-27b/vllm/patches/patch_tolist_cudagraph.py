print("club3090 stand-in: patch_tolist_cudagraph.py applied")
