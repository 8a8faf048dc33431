print("club3090 stand-in: vllm-gemma4-tool-parser-fixes/tool_parsers/gemma4_tool_parser.py applied")
