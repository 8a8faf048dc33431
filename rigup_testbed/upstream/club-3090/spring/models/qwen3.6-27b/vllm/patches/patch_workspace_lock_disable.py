print("club3090 stand-in: patch_workspace_lock_disable.py applied")
