"""llama.cpp on the benchmark of `tern-bench-models --only generate`: the same 980-token prompt for
prefill and the same chat prompt for 128 greedy tokens, 2 threads, median of 3 runs.

Set-up (builds llama.cpp from source, ~12 min on 2 cores):
    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" /tmp/llamacpp-venv/bin/pip install llama-cpp-python
Run:
    /tmp/llamacpp-venv/bin/python scripts/peers/llama_cpp_bench.py $TERN_MODELS_DIR/smollm2-135m-instruct/model.gguf
    /tmp/llamacpp-venv/bin/python scripts/peers/llama_cpp_bench.py $TERN_MODELS_DIR/gemma-3-270m/model.gguf gemma
The second argument picks the chat prompt's turn markers as tern's template renders them:
ChatML (default) or Gemma's.
"""
import time, sys, statistics
from llama_cpp import Llama
path = sys.argv[1]
llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=2048, n_batch=512, verbose=False)
sent = lambda i: f"{['The quiet engineer','A small red fox','Our weekly newsletter','The old harbour crane'][i%4]} {['quickly reviewed','slowly crossed','carefully described','proudly repaired'][(i//4)%4]} {['the long report on river pollution','a frozen field near the village','every change to the city budget','the broken gate behind the station'][(i//16)%4]} number {i}."
long = " ".join(sent(i) for i in range(60))
question = "Write a long story about a lighthouse keeper who finds a message in a bottle."
if len(sys.argv) > 2 and sys.argv[2] == "gemma":
    chat = f"<bos><start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"
else:
    chat = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
toks_long = llm.tokenize(long.encode(), add_bos=False, special=True)
toks_chat = llm.tokenize(chat.encode(), add_bos=False, special=True)
pre, dec = [], []
for run in range(3):
    llm.reset()
    t = time.perf_counter(); llm.eval(toks_long); pre.append(len(toks_long) / (time.perf_counter() - t))
    llm.reset()
    llm.eval(toks_chat)
    n = 128
    t = time.perf_counter()
    for i in range(n):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    dec.append(n / (time.perf_counter() - t))
print(f"llama.cpp: prefill {statistics.median(pre):.0f} tokens/s ({len(toks_long)} prompt tokens), decode {statistics.median(dec):.1f} tokens/s (prompt {len(toks_chat)} tokens, {n} generated, median of 3)")
