"""A small ResNet-18-style CNN (no torchvision needed).

Usage: autopar plan examples/convnet.py:resnet18ish --world-size 8 --cluster a100-80g
"""

from __future__ import annotations

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual (1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class ResNet(nn.Module):
    def __init__(self, num_classes: int = 1000, widths: tuple[int, ...] = (64, 128, 256, 512)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, c_in = [], widths[0]
        for i, c_out in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out)))
            c_in = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18ish(image_size: int = 224, num_classes: int = 1000, device: str | torch.device = "meta"):
    """ResNet-18 shapes and a batch of one (3, image_size, image_size) image."""
    with torch.device(device):
        model = ResNet(num_classes)
        x = torch.randn(1, 3, image_size, image_size)
    return model, (x,)
