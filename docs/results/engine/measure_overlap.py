from dflash2_mlx import generate
from dflash2_mlx.prompts import load_suites, parse_suites
from dflash2_mlx.session import Session

s = Session.open(None, progress=False)
prompts = [p for su in load_suites(parse_suites("gsm8k,humaneval,mtbench"), 2) for p in su.prompts]
res = {True: [], False: []}
for p in prompts[:1]:
    ids = s.encode(p.text); generate(s.target, ids, drafter=s.drafter, max_tokens=16, block_size=4, overlap=True); generate(s.target, ids, drafter=s.drafter, max_tokens=16, block_size=4, overlap=False)
for j, p in enumerate(prompts):
    ids = s.encode(p.text)
    toks = {}
    for o in ((True, False) if j % 2 == 0 else (False, True)):
        r = generate(s.target, ids, drafter=s.drafter, max_tokens=96, block_size=4, overlap=o)
        res[o].append((len(r.tokens) - 1, sum(c.draft_s + c.verify_s for c in r.cycles)))
        toks[o] = r.tokens
    assert toks[True] == toks[False]
rate = {o: sum(n for n, _ in v) / sum(t for _, t in v) for o, v in res.items()}
print("overlap", round(rate[True], 2), "sync", round(rate[False], 2), "ratio", round(rate[True] / rate[False], 3))
