#!/usr/bin/env python3
"""Push to first token under a pushed LoRA adapter's new version.

Starts `target/release/ferry serve --model MODEL --enable-lora --enable-admin-api`, pushes the
adapters in FOLDER1 and FOLDER2 (PEFT folders, e.g. from `ferry make-model lora --base MODEL
--rank 16`) alternately under one name with `/v1/push_lora_adapter?load_inplace=true`, and
after each push asks for one greedy token of a 128-token prompt under the adapter: prints the
push's time and the time from the push's first byte to that token, medians of 12, as JSON
(each answer's `lora_versions` must be the pushed version). Standard library only.

    python3 scripts/lora-push-latency.py MODEL FOLDER1 FOLDER2
"""
import json, subprocess, sys, time, urllib.request, urllib.parse, statistics, re
M, F1, F2 = sys.argv[1:4]
p = subprocess.Popen(["target/release/ferry","serve","--model",M,"--port","0","--enable-lora","--enable-admin-api"],
                     stderr=subprocess.PIPE, text=True)
url=None
for line in p.stderr:
    m=re.search(r"serving on (http://\S+)", line)
    if m: url=m.group(1); break
def post(path, body, data=None, q=""):
    if data is None:
        req=urllib.request.Request(url+path+q, json.dumps(body).encode(), {"content-type":"application/json"})
    else:
        req=urllib.request.Request(url+path+q, data, {"content-type":"application/octet-stream"})
    return json.load(urllib.request.urlopen(req))
folders={1: F1, 2: F2}
cfg={i: open(f"{folders[i]}/adapter_config.json").read() for i in (1,2)}
tens={i: open(f"{folders[i]}/adapter_model.safetensors","rb").read() for i in (1,2)}
def push(i):
    q="?"+urllib.parse.urlencode({"lora_name":"pol","config":cfg[i],"load_inplace":"true"})
    return post("/v1/push_lora_adapter", None, tens[i], q)
push(1)
prompt=list(range(10,138))
post("/v1/completions",{"model":"pol","prompt":prompt,"max_tokens":1,"temperature":0})
pushes=[];firsts=[]
for k in range(12):
    t0=time.perf_counter(); info=push(2 - k%2); t1=time.perf_counter()
    out=post("/v1/completions",{"model":"pol","prompt":prompt,"max_tokens":1,"temperature":0})
    t2=time.perf_counter()
    assert out["choices"][0]["lora_versions"]==[info["lora_version"]], out
    pushes.append(t1-t0); firsts.append(t2-t0)
print(json.dumps({"bytes":len(tens[1]),"push_s_median":statistics.median(pushes),"push_to_first_token_s_median":statistics.median(firsts),
  "push_to_first_token_s":[round(x,4) for x in firsts],"prompt_tokens":len(prompt)}))
p.kill()
