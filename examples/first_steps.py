import torch
import torch.distributed as dist
import fxsplit
from fxsplit.testing.zoo import GPT, GPTConfig, cross_entropy_loss

torch.manual_seed(0)  # every rank builds the same model and batch
model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64))  # any nn.Module
idx = torch.randint(0, 128, (8, 32))  # an example batch: (B, T) token ids
pm = fxsplit.parallelize(model, (idx,), loss_fn=cross_entropy_loss, tp=2, pp=2)  # tp=2 x pp=2: 4 ranks
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)  # each rank's own shards: any optimizer
for step in range(3):
    loss = pm.step(idx, target=torch.roll(idx, -1, dims=1))  # forward, loss, backward, all ranks
    opt.step(); opt.zero_grad()
    if dist.get_rank() == 0: print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
